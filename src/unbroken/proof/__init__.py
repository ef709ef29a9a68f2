"""Proof: comparing traces (`equivalence`), planning interruptions (`checkplan`), the
`unbroken check` harness (`harness`), its plot (`plot`), and `unbroken demo` (`demo`, with its
model `tinylm`)."""
