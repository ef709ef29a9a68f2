"""Many ranks: the job a Checkpointer belongs to (`group`), and the two-phase commit and the
agreed restore of one generation per job (`commit`)."""
