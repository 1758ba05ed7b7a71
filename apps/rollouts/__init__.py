"""Rollout plans (canary, blue-green): model and validation; execution lives in another issue."""
