"""Scale-out: engine replicas on Ray Serve with prefix-aware routing (runtime serve --replicas N).

routing.py is the policy (no Ray); ray_router.py wraps it as Ray Serve request routers; replica.py is the
deployment (one engine per replica); remote.py is the ingress side the HTTP and gRPC servers stream through.
Ray is an optional extra (pip install '.[cluster]'): nothing outside this package imports it.
"""
