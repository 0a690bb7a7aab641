"""Where processes run: learner ranks and replicas on nodes and GPUs (`placement`), and CPU pinning
on a shared machine (`cpu_affinity`)."""
