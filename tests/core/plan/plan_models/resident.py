"""This process's memory as /proc/self/status reports it, for the measure_* scripts."""


def status(key: str) -> int:
    """Bytes of ``key`` (``VmRSS``, ``VmHWM``) in /proc/self/status."""
    with open("/proc/self/status") as lines:
        for line in lines:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)
