"""Benchmark cases shared by `pddcore bench` and the pytest-benchmark files in bench/.

Every case reports a ratio against a baseline measured in the same run, because
absolute times on a shared machine are noise.
"""
