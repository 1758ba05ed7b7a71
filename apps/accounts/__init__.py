"""Users, roles (groups viewer/operator/admin), API tokens and the role-based API permission."""
