"""Ranks whose native code printf's a line and returns, under fork and spawn.

C's stdout on a pipe is fully buffered (unless Python runs with -u or PYTHONUNBUFFERED,
which the test unsets): a rank that ended with os._exit without fflush lost the line.
"""

import ctypes

import mgpu_helpers as mh


def printf_from_native_code():
    ctypes.CDLL(None).printf(b"native hello from %d\n", mh.rank())
    return mh.rank()


if __name__ == "__main__":
    for method in ("fork", "spawn"):
        mh.launch(printf_from_native_code, nprocs=2, start_method=method)
        print(f"{method} done", flush=True)
