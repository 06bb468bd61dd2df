"""Ray Serve: the OpenAI-compatible app (deployments.openai), the Serve application and its builder
(deployments.serve_app:build_app), and example serve configs (deployments/configs/)."""
