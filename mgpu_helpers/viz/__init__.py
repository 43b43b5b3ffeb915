"""Pictures: the chapters' plots (``plots``), the hand-drawn diagrams (``diagrams``) and
the planner's calculator widgets (``calculator``)."""
