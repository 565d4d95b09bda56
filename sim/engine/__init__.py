"""The engine: requests and their states, the KV block pool and cache, the step loop and its
compiled hot path, the timeline of steps and the event stream.
"""
