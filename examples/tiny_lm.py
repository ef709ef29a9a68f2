"""The demo's model as a script: a tiny character-level transformer language model trained
with everything that makes resuming hard (DataLoader workers with random masking, dropout,
accumulation, AdamW, warmup + cosine, clipping, a moving AMP loss scale, and Python and NumPy
randomness in the training loop). Its code is `unbroken/tinylm.py` (so `unbroken demo` can run
it from an installed package); this file runs it.

    python examples/tiny_lm.py --run runs/tinylm
    unbroken check --random 5 --seed 1 -- python examples/tiny_lm.py
"""

from unbroken.proof.tinylm import main

if __name__ == "__main__":
    main()
