"""The chapters' experiments and measurements: imported by notebooks and benchmarks, not
by the core helpers (a test checks the direction).

* :mod:`.augmentation_seeds`: chapter 02's rotation angles, to see who draws the same ones;
* :mod:`.collectives`: chapter 03's ring all-reduce and all-reduce cost model;
* :mod:`.threads`: chapter 04's GIL measurement (a second thread on a forward pass);
* :mod:`.scaling`: chapter 05's strong and weak scaling runs;
* :mod:`.scaling_rule`: chapter 05's learning-rate scaling rule on simulated ranks;
* :mod:`.ddp_internals`: chapter 05's backward timeline, ``Join``, clipping and ``no_sync``;
* :mod:`.native_stderr`: PyTorch's C++ stderr lines kept out of compared outputs (05, 07);
* :mod:`.throughput`: a timed epoch of chapter 05's DDP pipeline, optimisations switchable;
* :mod:`.gpipe`: chapter 06's pipeline schedules (GPipe, 1F1B, interleaved) timed, compared;
* :mod:`.zero`: chapter 07's ZeRO-3 linear layer from scratch;
* :mod:`.dcp`: chapter 07's distributed checkpoint, saved by 4 ranks and loaded by 2;
* :mod:`.recompute`: chapter 07's activation checkpointing, full and selective;
* :mod:`.mesh2d`: chapter 07's 2-D mesh, FSDP across and tensor parallelism within;
* :mod:`.memory`: chapter 07's memory at rest, at the peak and in traffic, DDP to FSDP2;
* :mod:`.fsdp_meters`: chapter 07's meters (step time, activations, bucket bytes) and the
  collectives an FSDP2 step runs, so that its cells show only the calls they teach;
* :mod:`.ablation`: chapter 08's ablation, judged against an A/A noise band;
* :mod:`.compiled_ddp`: chapter 08's ``torch.compile`` of a DDP model, one graph per bucket;
* :mod:`.debug_labs`: chapter 09's broken-and-fixed distributed programs, a module a topic:

  * :mod:`.debug_labs.failures`: ``TORCH_DISTRIBUTED_DEBUG``, a failure in one line;
  * :mod:`.debug_labs.hangs`: Lab 1, a collective one rank calls; ``monitored_barrier``;
  * :mod:`.debug_labs.desync`: Lab 2, collectives with mismatched shapes or order;
  * :mod:`.debug_labs.ddp_pitfalls`: Lab 3, an unused parameter under DDP, two fixes;
  * :mod:`.debug_labs.crash`: Lab 4, a rank killed mid-epoch, on the first attempt only;
  * :mod:`.debug_labs.replicas`: Lab 5, rank-dependent initialisation (DDP, FSDP2);
  * :mod:`.debug_labs.augmentation`: Lab 5, the same augmentations on every rank;
  * :mod:`.debug_labs.flight_recorder`: the flight recorder's dumps, one per process.
"""
