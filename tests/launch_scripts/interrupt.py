"""Interrupt a launch (as Jupyter's stop button does), then launch again.

``python interrupt.py running``: the interrupt comes while the ranks run. ``python
interrupt.py importing``: it comes while the launcher imports what forked ranks inherit
(the compiler, ``torch._dynamo``, on a launch's first call), sent the moment SymPy, which
it pulls in, looks for its late submodule ``sympy.parsing``: that half-finished import
(``sympy.logic`` loaded but never bound to the new ``sympy``) used to break every later
launch with "module 'sympy' has no attribute 'logic'"."""

import multiprocessing
import os
import signal
import sys
import threading
import time

import mgpu_helpers as mh


class InterruptOnImport:
    """A finder that finds nothing: it sends this process SIGINT when ``name`` is looked
    for, once."""

    def __init__(self, name):
        self.name = name

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None


def sleep_forever():
    print("started", flush=True)
    time.sleep(600)


def answer():
    return 42


if __name__ == "__main__":
    # Ctrl+C raises KeyboardInterrupt, as in a kernel, even where this script inherits
    # SIGINT ignored (a shell's background job: `make test &`), where Python installs no
    # handler and the interrupt would never come.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    when = sys.argv[1]
    if when == "running":
        threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    else:
        assert when == "importing" and "torch._dynamo" not in sys.modules
        sys.meta_path.insert(0, InterruptOnImport("sympy.parsing"))
    try:
        mh.launch(sleep_forever, nprocs=2)
    except KeyboardInterrupt:
        print("interrupted")
    print("children left:", multiprocessing.active_children())
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    print("second launch:", mh.launch(answer, nprocs=2))
