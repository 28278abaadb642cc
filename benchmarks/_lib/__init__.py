"""Plumbing every benchmark shares; runs in the driver process unless a function says otherwise."""
