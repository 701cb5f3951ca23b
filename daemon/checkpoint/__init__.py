"""Checkpoints: where they live (:mod:`.store`), what a record holds (:mod:`.envelope`), how
they are written (:mod:`.checkpointer`) and restored (:mod:`.restorer`)."""
