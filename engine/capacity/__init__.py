"""Memory arithmetic only: the capacity planner, published model shapes and the budget split."""
