"""Loopback load, fuzz and drain drivers for a live server (what bench/reliability.py and the reliability tests
run; they need the dev extra's hypothesis for the fuzzer)."""
