"""Reference solutions of the chapters' exercises, and plausible wrong ones: used only by
the tests (tests/test_exercises*.py), never by the notebooks."""
