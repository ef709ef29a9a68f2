"""Proof: comparing traces (`equivalence`), planning interruptions (`checkplan`), the
`unbroken check` harness (`harness`), its report (`report`) and plot (`plot`), and
`unbroken demo` (`demo`, with its model `tinylm`)."""
