"""What a run reports: the metrics table, one sink per file, the console, timing, provenance,
MFU and the report."""
