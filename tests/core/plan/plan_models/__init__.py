"""Small models for the planner's tests, built by ``module:function`` in a probe subprocess."""
