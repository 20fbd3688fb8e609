"""Process settings and the multi-process start: what a run asks of the machine."""
