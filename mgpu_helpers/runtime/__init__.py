"""The runtime: what this machine is and how a process finds its place on it.

Which devices and backend (``devices``, ``backend``, ``visible_devices``, ``topology``),
which numbers the hardware computes natively (``precision``), the environment report and
doctor (``env``), a rank's identity (``ranks``), the cluster's variables (``cluster``),
process-group reuse (``group_reuse``), where the clone's files are (``paths``), progress
bars that suit where the code runs (``progress``), the notebook settings check
(``notebook_settings``) and the one module that reaches private PyTorch names
(``private_apis``). It imports nothing else of the package.
"""
