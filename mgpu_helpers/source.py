"""``show(...)``: the source of functions and classes, highlighted in a notebook, where a
chapter teaches code that lives in the package (so tests import it, and the reader still
reads it in the chapter)."""

from __future__ import annotations

import inspect


def show(*objects):
    """The source of each of ``objects`` (functions, classes, methods, whole modules), one
    after the other, as an ``IPython.display.Code`` block: a notebook cell that ends with it shows
    the code highlighted, and its text as plain text elsewhere."""
    from IPython.display import Code

    if not objects:
        raise TypeError("show() needs at least one function or class to show")
    sources = []
    for item in objects:
        try:
            sources.append(inspect.getsource(item).rstrip("\n"))
        except TypeError:
            raise TypeError(f"show() shows functions, classes, methods and modules; got "
                            f"{type(item).__name__} {item!r}") from None
    return Code("\n\n\n".join(sources) + "\n", language="python")
