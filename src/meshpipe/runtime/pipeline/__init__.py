"""The public Pipeline and what it composes: building it, driving a step, introspection."""
