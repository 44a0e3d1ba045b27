"""HELM planner: config → IR → costs → machine profile → search → plan."""
