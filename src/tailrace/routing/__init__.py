"""Training a collaborative-generation router (``tailrace route train``): tree search over
routing paths (``tree``), tree-structured advantages (``advantages``), the logistic
policy and its file (``policy``), and the HumanEval environment (``humaneval``) that runs
paths on a ``backend: collab`` engine and verifies them by unit tests."""
