"""The differential fuzzer: random step programs against all replicas simulated on one device."""
