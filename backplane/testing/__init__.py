"""The conformance kit: reusable tests that every backend, in-tree or third-party, runs."""
