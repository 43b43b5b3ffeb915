"""Measuring tools: what went over the wire (``traffic``), what the NCCL flight recorder
saw (``flight_recorder``) and how much memory a run held (``memory``)."""
