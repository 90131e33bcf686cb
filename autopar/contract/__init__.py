"""The contract: what the planner writes and the runtime reads (the Plan, its placements, errors, files)."""
