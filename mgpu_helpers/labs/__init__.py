"""The chapters' experiments and measurements: imported by notebooks and benchmarks, not
by the core helpers (a test checks the direction).

* :mod:`.threads`: chapter 03's GIL measurement (a second thread on a forward pass);
* :mod:`.scaling`: chapter 04's strong and weak scaling runs;
* :mod:`.throughput`: one timed epoch of chapter 04's DDP pipeline, with switchable
  optimisations (for scaling and the ablation);
* :mod:`.ablation`: chapter 07's ablation, judged against an A/A noise band;
* :mod:`.gpipe`: chapter 05's GPipe step times and timelines;
* :mod:`.debug_labs`: chapter 08's broken-and-fixed distributed programs.
"""
