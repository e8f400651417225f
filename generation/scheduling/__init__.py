"""What each round verifies and what it costs: schedulers, the depth planner, measured cost tables."""
