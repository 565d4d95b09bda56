"""The service-time model: how long a step takes on given hardware (the cost model, hardware
and model presets, engine profiles), and fitting it to measurements (fit, calibrate, validate).
"""
