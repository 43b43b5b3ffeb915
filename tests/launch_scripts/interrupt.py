"""Interrupt a launch (as Jupyter's stop button does), then launch again."""

import multiprocessing
import os
import signal
import threading
import time

import mgpu_helpers as mh


def sleep_forever():
    print("started", flush=True)
    time.sleep(600)


def answer():
    return 42


if __name__ == "__main__":
    threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    try:
        mh.launch(sleep_forever, nprocs=2)
    except KeyboardInterrupt:
        print("interrupted")
    print("children left:", multiprocessing.active_children())
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    print("second launch:", mh.launch(answer, nprocs=2))
