"""Exclusive device time per wrapped function, synchronising around each call (the profile scripts)."""

import collections
import time


def op_timer(backend):
    """(totals, calls, timed): timed(name, function) wraps function so that its exclusive time
    (minus that of wrapped functions it calls) adds to totals[name] and each call to calls[name]."""
    totals, calls, stack = collections.Counter(), collections.Counter(), []

    def timed(name, function):
        def wrapper(*args, **kwargs):
            backend.synchronize()
            start = time.perf_counter()
            stack.append(0.0)
            result = function(*args, **kwargs)
            backend.synchronize()
            elapsed = time.perf_counter() - start
            inner = stack.pop()
            totals[name] += elapsed - inner
            calls[name] += 1
            if stack:
                stack[-1] += elapsed
            return result
        return wrapper

    return totals, calls, timed
