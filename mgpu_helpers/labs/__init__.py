"""The chapters' experiments and measurements: imported by notebooks and benchmarks, not
by the core helpers (a test checks the direction).

* :mod:`.collectives`: chapter 03's ring all-reduce and all-reduce cost model;
* :mod:`.threads`: chapter 04's GIL measurement (a second thread on a forward pass);
* :mod:`.scaling`: chapter 05's strong and weak scaling runs;
* :mod:`.scaling_rule`: chapter 05's learning-rate scaling rule on simulated ranks;
* :mod:`.ddp_internals`: chapter 05's backward timeline, uneven inputs with ``Join``,
  gradient clipping with a ``GradScaler`` and with ``no_sync``;
* :mod:`.throughput`: one timed epoch of chapter 05's DDP pipeline, with switchable
  optimisations (for scaling and the ablation);
* :mod:`.zero`: chapter 07's ZeRO-3 linear layer from scratch;
* :mod:`.dcp`: chapter 07's distributed checkpoint, saved by 4 ranks and loaded by 2;
* :mod:`.recompute`: chapter 07's activation checkpointing, full and selective;
* :mod:`.mesh2d`: chapter 07's 2-D mesh, FSDP across and tensor parallelism within;
* :mod:`.memory`: chapter 07's memory at rest and at the peak, and traffic per step, of
  DDP, ZeRO-1 and FSDP2;
* :mod:`.ablation`: chapter 08's ablation, judged against an A/A noise band;
* :mod:`.compiled_ddp`: chapter 08's ``torch.compile`` of a DDP model, one graph per
  bucket;
* :mod:`.gpipe`: chapter 06's pipeline step times, timelines and schedules compared
  (GPipe, 1F1B, interleaved 1F1B), overlap rounds, the first backward's cost;
* :mod:`.debug_labs`: chapter 09's broken-and-fixed distributed programs.
"""
