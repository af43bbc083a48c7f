"""Checks every implementation against every oracle, bit for bit; reproduces the challenge benchmark."""
