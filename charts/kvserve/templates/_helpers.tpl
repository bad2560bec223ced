{{/* Labels on every object; the names are fixed (one kvserve operator per cluster). */}}
{{- define "kvserve.labels" -}}
app.kubernetes.io/part-of: kvserve
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end }}

{{- define "kvserve.serviceAccountName" -}}
{{- default "kvserve-operator" .Values.serviceAccount.name }}
{{- end }}

{{- define "kvserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* What the operator does in the namespaces it watches (docs/operator.md). It writes what it
owns by server-side apply only: patch, and create for an apply that creates the object. */}}
{{- define "kvserve.namespacedRules" -}}
- apiGroups: [kvserve.dev]
  resources: [inferenceservices]
  verbs: [get, list, watch, patch]
- apiGroups: [kvserve.dev]
  resources: [inferenceservices/status]
  verbs: [patch]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, create, patch, delete]
# Replicas larger than one node (spec.gpu.gpusPerNode): LeaderWorkerSets, written the same way.
- apiGroups: [leaderworkerset.x-k8s.io]
  resources: [leaderworkersets]
  verbs: [get, create, patch, delete]
# Their size (groups) is set through the scale subresource only (operator/multinode.py).
- apiGroups: [leaderworkerset.x-k8s.io]
  resources: [leaderworkersets/scale]
  verbs: [get, patch]
- apiGroups: [""]
  resources: [services]
  verbs: [get, create, patch, delete]
# spec.adapters: the LoRA adapter list its pods' agents read (mounted, updated in place).
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, create, patch, delete]
# spec.runtime.kvOffload with storageClassName: the tier's claim. No delete: the API deletes it
# with its InferenceService (owner reference); the operator never does.
- apiGroups: [""]
  resources: [persistentvolumeclaims]
  verbs: [get, create, patch]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, create, patch, delete]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
# spec.parallelism.devicesPerPod: the admin key (runtime.adminApiKeySecret) the operator shows the
# pods' agents to change their layout in place; read by name, no list/watch.
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
- apiGroups: [""]
  resources: [serviceaccounts]
  verbs: [get, create, patch, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, create, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, create, patch, delete]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end }}

{{- define "kvserve.watchNamespace" -}}
{{- default .Release.Namespace .Values.rbac.watchNamespace }}
{{- end }}
