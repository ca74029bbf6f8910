"""Scores from prediction tables: frame- and video-level metrics, aggregation, plots, decision thresholds. Pure
functions of tables and arrays, so the fold job, the CV driver and the comparison compute them one way."""
