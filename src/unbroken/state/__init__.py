"""State: the live objects of a run as one tree of named parts (`parts`), the no-pickle
codec that turns it into safetensors and JSON (`codec`), every RNG stream (`rng`), the identity
of config, tokenizer and data (`identity`), and content digests for traces (`_digest`)."""
