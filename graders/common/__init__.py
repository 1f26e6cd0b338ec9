"""What more than one notebook's checks share: the collective spy (``comm_spy``), the model and data of exercise
2's training checks (``ddp_model``), the given parts of exercise 4's scripts (``torchrun_model``), and every
check's level-2 hint, its idea and the lesson section that teaches it (``concepts``)."""
