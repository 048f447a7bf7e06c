"""Synthetic inputs built on the spot: video clips (clips.py) and tiny random-weight models."""
