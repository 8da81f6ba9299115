"""Planning a step: calibrated survival and its lag ring, the budget, the allocation, the planner."""
