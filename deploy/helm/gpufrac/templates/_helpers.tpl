{{/* Common helpers. */}}

{{- define "gpufrac.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{- define "gpufrac.labels" -}}
app.kubernetes.io/part-of: gpufrac
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Labels of one component: (dict "root" $ "component" "scheduler"). */}}
{{- define "gpufrac.componentLabels" -}}
{{ include "gpufrac.labels" .root }}
app.kubernetes.io/name: gpufrac-{{ .component }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "gpufrac.selector" -}}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/name: gpufrac-{{ .component }}
{{- end }}

{{/* "true" when the master switch and the component's switch are both on; gpufrac's scheduler is off
when KAI Scheduler schedules (`kai.enabled`). */}}
{{- define "gpufrac.on" -}}
{{- $kaiSchedules := and (eq .component "scheduler") .root.Values.kai.enabled }}
{{- if and .root.Values.enabled (index .root.Values .component "enabled") (not $kaiSchedules) }}true{{ end }}
{{- end }}

{{/* DRA is on (docs/dra.md): dra.enabled true, or auto on a cluster that serves resource.k8s.io/v1. */}}
{{- define "gpufrac.draOn" -}}
{{- $dra := toString .Values.dra.enabled }}
{{- if and .Values.enabled (or (eq $dra "true") (and (eq $dra "auto") (.Capabilities.APIVersions.Has "resource.k8s.io/v1/DeviceClass"))) }}true{{ end }}
{{- end }}

{{- define "gpufrac.schedulerUser" -}}
system:serviceaccount:{{ .Release.Namespace }}:gpufrac-scheduler
{{- end }}

{{/* The node agents' heartbeat Leases' namespace: gpufrac.contract.keys.NODE_LEASE_NAMESPACE. */}}
{{- define "gpufrac.nodeLeaseNamespace" -}}
gpufrac-node-lease
{{- end }}

{{- define "gpufrac.admissionService" -}}
gpufrac-admission
{{- end }}

{{/* Pod-level settings shared by the Deployments: (dict "root" $ "values" .Values.scheduler). */}}
{{- define "gpufrac.podPlacement" -}}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "gpufrac.containerSecurity" -}}
securityContext:
  runAsNonRoot: true
  runAsUser: 65532
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  capabilities:
    drop: ["ALL"]
{{- end }}

{{/* A webhook's clientConfig (the chart's Service), timeout and namespaceSelector. */}}
{{- define "gpufrac.webhookClient" -}}
clientConfig:
  caBundle: {{ .caBundle }}
  service:
    namespace: {{ .namespace }}
    name: {{ .service }}
    port: 443
    path: {{ .path }}
timeoutSeconds: {{ .timeout }}
namespaceSelector:
  {{- toYaml .selector | nindent 2 }}
objectSelector: {}
{{- end }}
