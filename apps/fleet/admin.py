"""Admin for clusters and links (saves go through the fleet services) and the observed state (read-only).

The pool admin is operations' (:mod:`apps.operations.admin`): deleting and scaling a pool record Actions."""

from __future__ import annotations

import json
from typing import Any

from django import forms
from django.contrib import admin
from django.db import models
from django.db.models import QuerySet
from django.http import HttpRequest

from apps.fleet import selectors, services
from apps.fleet.models import Cluster, ClusterLink, Replica, Router, RoutingTable
from apps.fleet.routing_table import content_redacted


def model_fields(form: forms.ModelForm, only_changed: bool = False) -> dict[str, Any]:
    """The form's cleaned values of model fields (only the changed ones when ``only_changed``)."""
    names = {f.name for f in form._meta.model._meta.get_fields()}
    keys = set(form.changed_data) if only_changed else set(form.cleaned_data)
    return {k: v for k, v in form.cleaned_data.items() if k in names and k in keys}


@admin.register(Router)
class RouterAdmin(admin.ModelAdmin):
    """The router registry (admin-only writes: the admin site is for staff, i.e. the admin role)."""

    list_display = ("name", "cluster", "url", "created_at")
    list_filter = ("cluster",)
    search_fields = ("name", "url")
    readonly_fields = ("created_at", "updated_at")

    def save_model(self, request: HttpRequest, obj: Router, form: forms.ModelForm, change: bool) -> None:
        if change:
            services.router_update(router=Router.objects.get(pk=obj.pk), **model_fields(form, True))
        else:
            obj.pk = services.router_create(**model_fields(form)).pk

    def delete_model(self, request: HttpRequest, obj: Router) -> None:
        services.router_delete(router=obj)


@admin.register(Cluster)
class ClusterAdmin(admin.ModelAdmin):
    list_display = ("name", "kind", "datacenter", "status", "namespace", "agent_url", "created_at")
    list_filter = ("kind", "status", "datacenter")
    search_fields = ("name", "datacenter")
    readonly_fields = ("status", "created_at", "updated_at")
    formfield_overrides = {models.URLField: {"assume_scheme": "http"}}  # agents listen on plain HTTP loopback

    def save_model(self, request: HttpRequest, obj: Cluster, form: forms.ModelForm, change: bool) -> None:
        if change:
            services.cluster_update(cluster=Cluster.objects.get(pk=obj.pk), **model_fields(form, True))
        else:
            obj.pk = services.cluster_create(**model_fields(form)).pk

    def delete_model(self, request: HttpRequest, obj: Cluster) -> None:
        services.cluster_delete(cluster=obj)


@admin.register(ClusterLink)
class ClusterLinkAdmin(admin.ModelAdmin):
    list_display = ("__str__", "source", "destination", "bandwidth_gbps", "rtt_ms")
    list_filter = ("source", "destination")
    search_fields = ("source__name", "destination__name")
    list_select_related = ("source", "destination")

    def save_model(self, request: HttpRequest, obj: ClusterLink, form: forms.ModelForm, change: bool) -> None:
        if change:
            services.cluster_link_update(link=ClusterLink.objects.get(pk=obj.pk), **model_fields(form, True))
        else:
            obj.pk = services.cluster_link_create(**model_fields(form)).pk

    def delete_model(self, request: HttpRequest, obj: ClusterLink) -> None:
        services.cluster_link_delete(link=obj)


class _ReadOnlyAdmin(admin.ModelAdmin):
    """Observed state: written by reconcile, never by hand."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False


@admin.register(Replica)
class ReplicaAdmin(_ReadOnlyAdmin):
    list_display = ("name", "pool", "track", "endpoint", "ready", "alive", "version", "restart_count", "last_seen")
    list_filter = ("ready", "alive", "track", "pool__cluster")
    search_fields = ("name", "endpoint", "pool__name")

    def get_queryset(self, request: HttpRequest) -> QuerySet[Replica]:
        return selectors.replica_list()


@admin.register(RoutingTable)
class RoutingTableAdmin(_ReadOnlyAdmin):
    """The published table, its pools' worker tokens left out (:func:`content_redacted`)."""

    list_display = ("version", "digest", "published_at")
    fields = ("version", "digest", "published_at", "content_without_secrets")
    readonly_fields = fields

    @admin.display(description="content (worker tokens left out)")
    def content_without_secrets(self, obj: RoutingTable) -> str:
        return json.dumps(content_redacted(obj.content), indent=2, sort_keys=True)
