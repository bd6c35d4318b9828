{{- define "dsv4.fullname" -}}
{{- printf "%s-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "dsv4.serviceAccountName" -}}
{{- default (include "dsv4.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "dsv4.labels" -}}
app.kubernetes.io/name: dsv4
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "dsv4.selectorLabels" -}}
app.kubernetes.io/name: dsv4
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* Namespaced permissions: everything a DeepSeekV4Deployment owns, and the CRs themselves. */}}
{{- define "dsv4.namespacedRules" -}}
- apiGroups: [serving.dsv4.io]
  resources: [deepseekv4deployments]
  verbs: [get, list, watch, patch]
- apiGroups: [serving.dsv4.io]
  resources: [deepseekv4deployments/status]
  verbs: [get, patch, update]
- apiGroups: [serving.dsv4.io]
  resources: [deepseekv4rolescales]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [serving.dsv4.io]
  resources: [deepseekv4rolescales/status]
  verbs: [get, patch, update]
- apiGroups: [""]
  resources: [configmaps, services, serviceaccounts, secrets]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
- apiGroups: [events.k8s.io]
  resources: [events]
  verbs: [create, patch]
- apiGroups: [apps]
  resources: [statefulsets, deployments]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [leaderworkerset.x-k8s.io]
  resources: [leaderworkersets]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, list, watch, create, patch, update, delete]
# held so the operator may grant it to each gateway (RBAC forbids granting what you lack)
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [get, list, watch]
- apiGroups: [kopf.dev]
  resources: [kopfpeerings]
  verbs: [get, list, watch, patch]
{{- end -}}
