"""Cost models: the base formulas and precision layouts (``costs``), the parallelism
planner (``planner``) and the strategy map's memory budgets (``strategy``)."""
