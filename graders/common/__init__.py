"""What more than one notebook's checks share: the collective spy (``comm_spy``), the model and data of exercise
2's training checks (``ddp_model``), and the given parts of exercise 4's scripts (``torchrun_model``)."""
