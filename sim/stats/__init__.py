"""A run's figures: the summary and rolling metrics, and the quantile sketches they fold.
"""
