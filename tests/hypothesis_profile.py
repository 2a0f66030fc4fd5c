"""Hypothesis example counts come from one profile, chosen by FUSION_HYPOTHESIS_PROFILE.

- ``ci`` (the default, ``make test``): derandomized, so a failure reproduces on every run, and at
  most ``CI_EXAMPLES`` examples a test: under the Triton interpreter an example costs 0.2-2 s.
- ``nightly`` (``make test-nightly``): random examples, each test's full count.

A test writes its full count through ``examples``: ``@settings(max_examples=examples(20))``. An
explicit ``max_examples=N`` would override the profile in both tiers.
"""

from __future__ import annotations

import os

from hypothesis import settings

CI_EXAMPLES = 4
settings.register_profile("ci", derandomize=True, deadline=None, max_examples=CI_EXAMPLES, print_blob=True)
settings.register_profile("nightly", deadline=None)
PROFILE = os.environ.get("FUSION_HYPOTHESIS_PROFILE", "ci")
settings.load_profile(PROFILE)  # an unknown name raises InvalidArgument, naming the registered ones


def examples(full: int) -> int:
    """``full`` under the nightly profile; under ci at most the profile's count."""
    return full if PROFILE == "nightly" else min(full, settings.default.max_examples)
