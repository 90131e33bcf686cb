"""The planner: capture, op rules, intra-op ILP, stage DP; reads the contract and cost_models."""
