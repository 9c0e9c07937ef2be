"""Speculative-decoding benchmark harness.

The harness owns everything a method must not do itself: loading models, counting forward passes,
timing (warm-up, device sync, clocks), seeding, metrics and writing results. Methods live in
``methods/``, one per file, and only decode.
"""

__version__ = "0.1.0"
