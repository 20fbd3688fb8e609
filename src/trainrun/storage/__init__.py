"""The storage layer, on the bottom floor: a location is a local path or a ``gs://`` or
``s3://`` one, and every read, write, listing and atomic commit of a file goes through it.

``location.py`` (the operations, whichever store), ``remote.py`` (object storage: whole
objects, ranged reads, listings, retries within a deadline), ``atomic.py`` (a local file
written beside its place and renamed into it, never through a link). The run directory
(``trainrun.rundir``), the models' weights and the data all read and write through it.
"""
