"""Forms behind the browser pages: agents, conversations, API keys and accounts."""
from django import forms
from django.contrib.auth import get_user_model
from django.contrib.auth.forms import UserCreationForm
from django.utils.text import slugify

from .models import Agent, Conversation


class AgentForm(forms.ModelForm):
    """An agent's settings. Staff also choose the review policy; everyone else keeps the default."""

    class Meta:
        model = Agent
        fields = [
            "name", "description", "system_prompt", "temperature", "max_tokens",
            "training_enabled", "training_method", "alpha", "review_policy",
        ]
        widgets = {
            "system_prompt": forms.Textarea(attrs={"rows": 6, "placeholder": "You are a helpful assistant…"}),
            "description": forms.TextInput(attrs={"placeholder": "What this agent is for (optional)"}),
        }
        labels = {
            "max_tokens": "Max tokens per reply",
            "training_enabled": "Learn from my feedback",
            "alpha": "OPD weight (α)",
        }
        help_texts = {
            "temperature": "0 is deterministic; higher is more varied (0–2).",
            "training_method": "How thumbs and corrections train your personal adapter.",
            "alpha": "Weight of the hindsight-OPD loss in the combined method (0–1).",
        }

    def __init__(self, *args, user, **kwargs):
        super().__init__(*args, **kwargs)
        self.user = user
        if not user.is_staff:
            del self.fields["review_policy"]
        self.fields["temperature"].widget.attrs.update(min=0, max=2, step=0.05)
        self.fields["max_tokens"].widget.attrs.update(min=1, max=4096)
        self.fields["alpha"].widget.attrs.update(min=0, max=1, step=0.05)
        # OFFLINE is the benchmark baseline, not something a user should pick.
        self.fields["training_method"].choices = [
            c for c in self.fields["training_method"].choices if c[0] != Agent.Method.OFFLINE
        ]

    def clean_temperature(self):
        value = self.cleaned_data["temperature"]
        if not 0 <= value <= 2:
            raise forms.ValidationError("Temperature must be between 0 and 2.")
        return value

    def clean_max_tokens(self):
        value = self.cleaned_data["max_tokens"]
        if not 1 <= value <= 4096:
            raise forms.ValidationError("Max tokens must be between 1 and 4096.")
        return value

    def clean_alpha(self):
        value = self.cleaned_data["alpha"]
        if not 0 <= value <= 1:
            raise forms.ValidationError("α must be between 0 and 1.")
        return value

    def clean_name(self):
        name = self.cleaned_data["name"].strip()
        if not slugify(name):
            raise forms.ValidationError("Use at least one letter or digit in the name.")
        return name

    def save(self, commit=True):
        agent = super().save(commit=False)
        if agent.pk is None:
            agent.owner = self.user
        if agent.pk is None or "name" in self.changed_data:
            agent.slug = self._unique_slug(agent)
        if commit:
            agent.save()
        return agent

    def _unique_slug(self, agent):
        """The name's slug, numbered when the owner already has an agent by that slug."""
        base = slugify(agent.name)[:90] or "agent"
        taken = set(
            Agent.objects.filter(owner=agent.owner, slug__startswith=base).exclude(pk=agent.pk).values_list("slug", flat=True)
        )
        slug, n = base, 2
        while slug in taken:
            slug, n = f"{base}-{n}", n + 1
        return slug


class ConversationRenameForm(forms.ModelForm):
    class Meta:
        model = Conversation
        fields = ["title"]

    def clean_title(self):
        title = self.cleaned_data["title"].strip()
        if not title:
            raise forms.ValidationError("A title can't be empty.")
        return title


class ApiKeyForm(forms.Form):
    name = forms.CharField(max_length=100, widget=forms.TextInput(attrs={"placeholder": "e.g. laptop script"}))


class SignupForm(UserCreationForm):
    class Meta(UserCreationForm.Meta):
        model = get_user_model()
        fields = ["username", "email"]


class InviteForm(forms.Form):
    """Staff create an account without a password; the invitee sets one through a link."""

    username = forms.CharField(max_length=150)
    email = forms.EmailField(required=False)

    def clean_username(self):
        username = self.cleaned_data["username"].strip()
        User = get_user_model()
        User.username_validator(username)
        if User.objects.filter(username__iexact=username).exists():
            raise forms.ValidationError("A user with that username already exists.")
        return username

    def save(self):
        user = get_user_model().objects.create_user(
            username=self.cleaned_data["username"], email=self.cleaned_data["email"], password=None
        )
        return user
