"""Level 2 of every check's hint: the idea it tests, and the lesson section that teaches it.

``CONCEPTS[notebook package][check] = (idea, lesson, section)``: ``lesson`` is a lesson notebook's name
(``02-ddp-basics`` for ``lessons/02-ddp-basics.ipynb``) and ``section`` one of its headings, as written there
(without the ``#``). A failed check's first message says what is wrong; a student who asks for more gets this
(:mod:`course.grading.hints`), then the check's own ``hint``. Every public check of every notebook's package has
an entry (tests/test_hints.py); an idea names the principle, never the code that solves the part. One module for
every notebook, so that a lesson's sections and the checks that send students to them are read together.
"""

from __future__ import annotations

L1, L2, L3, L4 = ("01-data-vs-model-parallelism", "02-ddp-basics", "03-syncbatchnorm-and-sharded-state",
                  "04-launching-with-torchrun")

CONCEPTS: dict[str, dict[str, tuple[str, str, str]]] = {
    "parallelism": {
        "check_shards": ("data parallelism splits the global batch: every row belongs to exactly one rank, "
                         "whatever the world size", L1, "3. Data parallelism: split the batch"),
        "check_shard_sizes": ("when the batch does not divide evenly, the shares differ by at most one row, so "
                              "no rank's mean counts more than another's", L1, "The batch size: per rank, not global"),
        "check_average_gradients": ("the gradient of the whole batch is a mean over every row, not a mean of the "
                                    "ranks' means when shares differ in size", L1,
                                    "The learning rate: average, don't sum"),
        "check_two_stage": ("model parallelism splits the layers: activations travel forward to the next stage, "
                            "their gradients travel back", L1, "4. Model parallelism: split the layers"),
        "check_tensor_parallel": ("a layer split by columns then by rows gives partial outputs that sum to the "
                                  "whole; the gradient of the input sums the same way", L1,
                                  "5. Tensor parallelism: split inside a layer"),
        "check_tensor_parallel_collectives": ("a split MLP needs one sum of partial results in the forward and "
                                              "one in the backward, and nothing else", L1,
                                              "Gradients through a split layer"),
    },
    "pipeline": {
        "check_pipeline_gradients": ("micro-batches through a pipeline add up to the whole batch's gradient: each "
                                     "micro-batch's loss is its share of the batch's, and every activation and "
                                     "gradient reaches the stage that needs it", L1, "Schedules: GPipe and 1F1B"),
        "check_pipeline_schedule": ("a schedule is each stage's order of forwards and backwards: GPipe runs every "
                                    "forward first and holds every micro-batch, 1F1B starts backwards as early as the "
                                    "stages allow and holds at most p - s", L1, "Schedules: GPipe and 1F1B"),
        "check_pipeline_prediction": ("the bubble is the share of stage-steps spent idle, set by the stages and the "
                                      "micro-batches; a stage holds a micro-batch from its forward to its backward",
                                      L1, "Schedules: GPipe and 1F1B"),
    },
    "expert_parallel": {
        "check_moe_outputs": ("each token travels to the rank of its expert and its output comes back to its own "
                              "place; an expert's capacity is shared by every rank's tokens", L1,
                              "Splitting the experts: expert parallelism"),
        "check_moe_gradients": ("the way back carries gradients only through collectives autograd knows: the "
                                "backward of an all-to-all is the reverse all-to-all", L1,
                                "Gradients through a split layer"),
        "check_moe_dispatch": ("an expert spends compute only on the tokens it keeps: a token past its capacity is "
                               "dropped before it is sent", L1, "Splitting the experts: expert parallelism"),
    },
    "ddp_basics": {
        "check_setup": ("each process joins one process group as its own rank of the world size, with the "
                        "backend of its device; a job can make more groups, each with a backend of its own, and "
                        "collectives on CPU tensors need a CPU backend", L2, "3. `init_process_group` and the backend"),
        "check_training": ("DDP averages the ranks' gradients during backward, so every rank takes the same step; "
                           "whether that step is one process's on the global batch depends on how the loss is "
                           "reduced: an average of per-rank means is the global mean, an average of per-rank sums "
                           "is not the global sum", L2, "6. Gradients are all-reduced during backward"),
        "check_checkpoint": ("one rank writes the checkpoint, the others wait for it; the saved state is the "
                             "plain model's, not the wrapper's; what differs on every rank (its random generator's "
                             "state) reaches the one writer only if each rank sends it", L2,
                             "9. Checkpoints: rank 0 saves, everyone else waits, then loads"),
        "check_cleanup": ("a job leaves its process group at the end, on every rank", L2,
                          "10. `destroy_process_group()` at the end"),
        "check_sampler_shards": ("a distributed sampler gives each rank an equal share of the indices, padded or "
                                 "dropped so the shares have the same length", L2,
                                 "7. `DistributedSampler`: each rank its own shard"),
        "check_sampler_order": ("a sampler's shuffle is a function of its seed and the epoch only, so every rank "
                                "computes the same permutation", L2, "8. `sampler.set_epoch(epoch)`"),
        "check_sampler_training": ("with a sampler in a DataLoader, every rank takes the same number of steps and "
                                   "each epoch covers the dataset", L2, "Using the sampler with a `DataLoader`"),
        "check_set_epoch": ("the sampler only reshuffles when it is told which epoch it is", L2,
                            "8. `sampler.set_epoch(epoch)`"),
    },
    "ddp_from_scratch": {
        "check_broadcast": ("data-parallel replicas start from the same weights: one rank's are copied to all",
                            L2, "5. Wrapping the model"),
        "check_naive": ("after backward, every gradient is averaged over the ranks before the optimizer step",
                        L2, "6. Gradients are all-reduced during backward"),
        "check_bucketed": ("gradients are averaged in buckets, groups of tensors sent in one collective each", L2,
                           "How DDP really syncs: buckets, hooks, overlap"),
        "check_buckets": ("a bucket fills in the order gradients become ready and closes once it reaches its "
                          "size cap", L2, "How DDP really syncs: buckets, hooks, overlap"),
        "check_overlap": ("a bucket's collective can start while backward still computes the earlier layers' "
                          "gradients", L2, "How DDP really syncs: buckets, hooks, overlap"),
        "check_step_plan": ("each strategy (DDP, ZeRO, FSDP) issues its own collectives per step, sized by what "
                            "it shards", L1, "Beyond DDP: what sharding costs in traffic"),
        "check_step_cost": ("a collective's time is latency per message plus bytes over bandwidth, with the "
                            "ring's traffic per rank", L1, "How long an all-reduce takes: latency and bandwidth"),
    },
    "ddp_in_practice": {
        "check_load_checkpoint": ("a checkpoint remembers the device it was saved from; each rank loads onto its "
                                  "own device", L2, "9. Checkpoints: rank 0 saves, everyone else waits, then loads"),
        "check_hardest": ("a result over a sharded dataset that is not a sum (the k hardest samples) needs every "
                          "rank's candidates on every rank, gathered as objects or padded to one size, each sample "
                          "evaluated once", L2, "What differs on every rank: one rank collects it"),
        "check_no_sync": ("gradient accumulation needs one all-reduce per optimizer step, not one per "
                          "micro-batch", L2, "Two things that go wrong in backward"),
        "check_accumulation": ("accumulated micro-batches must give the gradient of the mean loss over all of "
                               "them", L2, "Two things that go wrong in backward"),
        "check_uneven": ("ranks with different numbers of batches must still call the same collectives; the "
                         "mean is over the ranks that trained", L2, "7. `DistributedSampler`: each rank its own shard"),
        "check_amp_step": ("float16 mixed precision computes in float16, keeps float32 master weights and scales "
                           "the loss so that small gradients survive; an overflow anywhere skips the step on every "
                           "rank", L2, "float16 needs a GradScaler"),
        "check_amp_sync": ("accumulation with mixed precision still all-reduces once per optimizer step", L2,
                           "12. Mixed precision and gradient clipping under DDP"),
        "check_clip": ("clipping acts on the true (unscaled) averaged gradient, after DDP's all-reduce, the same on "
                       "every rank", L2, "12. Mixed precision and gradient clipping under DDP"),
    },
    "debug_training": {
        "check_finishes": ("every rank must reach the same collectives; a rank that skips one leaves the others "
                           "waiting", L2, "9. Checkpoints: rank 0 saves, everyone else waits, then loads"),
        "check_shuffle": ("each epoch needs a new order, the same on every rank, that covers the dataset", L2,
                          "8. `sampler.set_epoch(epoch)`"),
        "check_metric": ("a metric of the whole validation set combines every rank's counts", L2,
                         "Evaluating across ranks"),
        "check_checkpoint": ("the saved state is the plain model's, written once, complete before anyone reads "
                             "it", L2, "9. Checkpoints: rank 0 saves, everyone else waits, then loads"),
    },
    "syncbn_sharding": {
        "check_syncbn_output": ("synchronised BatchNorm normalises with the statistics of the global batch, "
                                "combined from every rank's", L3, "3. A SyncBatchNorm you can run on a CPU"),
        "check_syncbn_backward": ("the gradient must flow back through the communication of the statistics", L3,
                                  "3. A SyncBatchNorm you can run on a CPU"),
        "check_syncbn_running_stats": ("running statistics follow BatchNorm's update with the global batch's "
                                       "mean and unbiased variance", L3, "3. A SyncBatchNorm you can run on a CPU"),
        "check_syncbn_accuracy": ("the way the statistics are combined decides how much float32 precision is "
                                  "lost", L3, "3b. Why torch does not all-reduce sums: cancellation in float32"),
        "check_shard_save": ("with a sharded optimizer each rank holds, and saves, only its own share of the "
                             "state", L3, "4. Sharding the optimizer state: `ZeroRedundancyOptimizer`"),
        "check_shard_load": ("the shards the ranks saved together make the whole optimizer state", L3,
                             "4. Sharding the optimizer state: `ZeroRedundancyOptimizer`"),
        "check_zero_memory": ("sharding the optimizer divides its state by the world size; parameters and "
                              "gradients stay whole", L3, "6. Optimizer memory per rank, with and without sharding"),
        "check_fsdp_memory": ("fully sharding divides parameters, gradients and optimizer state by the world "
                              "size", L3, "6. Optimizer memory per rank, with and without sharding"),
    },
    "sharded_optimizer": {
        "check_zero_weights": ("with the optimizer state sharded, each rank updates only its own partition: the "
                               "new values exist on that rank alone until every rank gathers them", L3,
                               "4b. A sharded optimizer by hand"),
        "check_zero_state": ("ZeRO gives each element of the flattened parameters one owner for the whole training, "
                             "an even share of the elements per rank", L3, "4b. A sharded optimizer by hand"),
        "check_zero_gradients": ("the step's gradient is the mean over every micro-batch of every rank; stage 1 "
                                 "reduces it once a step, stage 2 reduces each micro-batch's so that a rank keeps "
                                 "only its own partition's share", L3, "4b. A sharded optimizer by hand"),
        "check_zero_memory": ("memory per rank is what each rank keeps of the weights, the gradients and the "
                              "optimizer state, each either whole or split over the ranks", L3,
                              "6. Optimizer memory per rank, with and without sharding"),
    },
    "activation_memory": {
        "check_saved_bytes": ("each operation keeps for its backward the tensors its gradient needs, held from the "
                              "forward to the backward; the parameters are not activations", L3,
                              "8. Activation memory: what backward keeps, and checkpointing"),
        "check_checkpoint_gradients": ("a checkpointed block runs its forward again when its backward comes, with "
                                       "the same input: the gradients are those of the model without checkpointing",
                                       L3, "8. Activation memory: what backward keeps, and checkpointing"),
        "check_checkpoint_plan": ("checkpointing trades memory for recomputation: a checkpointed block holds its "
                                  "activations only from its recomputation to its backward, while the kept blocks "
                                  "before it are still held", L3,
                                  "8. Activation memory: what backward keeps, and checkpointing"),
    },
    "two_dimensions": {
        "check_mesh_losses": ("on a mesh, a tensor-parallel shard's output is partial: the model's output is the sum "
                              "over the shard's row only", L3, "9. Two dimensions: a device mesh"),
        "check_mesh_gradients": ("the copies of a shard live in one column: its gradient is averaged there, and the "
                                 "loss's gradient reaches each shard once, however many ranks of a row computed it",
                                 L3, "9. Two dimensions: a device mesh"),
        "check_mesh_training": ("the copies of a shard stay equal when every copy takes the same averaged step", L3,
                                "9. Two dimensions: a device mesh"),
        "check_mesh_prediction": ("a tensor on a mesh has one placement per dimension: the same copy along one, a "
                                  "slice along the other; a collective carries the tensor it reduces", L3,
                                  "9. Two dimensions: a device mesh"),
    },
    "fsdp_checkpoint": {
        "check_shard": ("fully sharding splits each unit's parameters across the ranks and gathers a unit "
                        "just before it runs", L3, "5. Sharding everything: FSDP2 `fully_shard`"),
        "check_training": ("the optimizer must see the sharded parameters, so it is built after sharding; param "
                           "groups pick parameters by what a DTensor reports of the full tensor", L3,
                           "5. Sharding everything: FSDP2 `fully_shard`"),
        "check_checkpoint": ("a distributed checkpoint has each rank write its own shard, and any set of its keys "
                             "loads at any world size into a model that matches them", L3,
                             "5. Sharding everything: FSDP2 `fully_shard`"),
        "check_export_parts": ("a full tensor is gathered by a collective every rank calls; the work after it can be "
                               "split among the ranks by bytes", L3, "5. Sharding everything: FSDP2 `fully_shard`"),
        "check_mixed_precision": ("a precision policy says which dtype parameters are gathered and computed in, "
                                  "and which gradients are reduced in", L3,
                                  "7. Mixed precision and clipping with FSDP2"),
        "check_clipping": ("the norm of a sharded gradient combines every rank's shard", L3,
                           "Clipping a sharded gradient"),
    },
    "torchrun": {
        "check_standalone_ranks": ("torchrun tells each worker its rank, local rank and world size through its "
                                   "environment", L4, "1. A script, and what torchrun tells each process"),
        "check_multinode_ranks": ("on several nodes the local rank counts within a node, the rank across the "
                                  "job", L4, "2. Two nodes on one machine: rendezvous"),
        "check_ddp_training": ("a script under torchrun trains as one process would on every rank's batches",
                               L4, "The reference: an uninterrupted run"),
        "check_destroy": ("every worker leaves its process group before it exits", L2,
                          "10. `destroy_process_group()` at the end"),
        "check_checkpoint_rank0": ("one worker writes the checkpoint, after every epoch", L4,
                                   "3. Fault tolerance: restart and resume"),
        "check_atomic_checkpoint": ("a checkpoint a crash can interrupt must never be read half written", L4,
                                    "3. Fault tolerance: restart and resume"),
        "check_restart_resume": ("after a restart the workers resume from the last checkpoint, not from the "
                                 "start", L4, "A crash, and a restart"),
    },
    "elastic": {
        "check_elastic_shrink": ("an elastic job restarts at the new size from the last checkpoint and "
                                 "re-divides the work among the workers it has", L4,
                                 "4. Elastic jobs: a node leaves, the job goes on; a node joins, the job grows"),
        "check_elastic_grow": ("a grown job resumes from the smaller job's checkpoint and still sees every "
                               "sample once per epoch", L4,
                               "4. Elastic jobs: a node leaves, the job goes on; a node joins, the job grows"),
    },
    "find_the_hang": {
        "check_diagnosis": ("a hang is read from the ranks' collectives: which rank waits in which one, and "
                            "which rank never came", L4, "6. Finding a hang"),
        "check_diagnosis_early": ("a rank that leaves early leaves the others waiting in the next collective",
                                  L4, "The course's stall report"),
        "check_diagnosis_metric": ("a collective called on some ranks only waits forever", L4,
                                   "`dist.monitored_barrier`: who never arrived"),
        "check_diagnosis_shapes": ("a collective's tensors must have the same shape on every rank", L4,
                                   "torch's flight recorder"),
        "check_diagnosis_uneven": ("ranks that run different numbers of steps call different numbers of "
                                   "collectives", L4, "The course's stall report"),
        "check_fix": ("every rank must call the same collectives, in the same order, with the same shapes", L4,
                      "6. Finding a hang"),
        "check_fix_early": ("every rank takes part in each collective, and reads shared results only after "
                            "everyone has written them", L4, "6. Finding a hang"),
        "check_fix_metric": ("a value every rank computes is combined by every rank; only the logging is one "
                             "rank's", L4, "6. Finding a hang"),
        "check_fix_shapes": ("tensors in a collective need one shape on every rank, whatever each rank's data "
                             "holds", L4, "torch's flight recorder"),
        "check_fix_uneven": ("ranks must run the same number of synchronised steps and still cover every "
                             "sample", L4, "6. Finding a hang"),
    },
}
